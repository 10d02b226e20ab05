"""Where Kubernetes objects come from (files now, the API server later)."""
