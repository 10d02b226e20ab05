"""The cluster layer: what a node's kproxy and a rollout say to each other through the API."""
