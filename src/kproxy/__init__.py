"""kproxy: a Kubernetes service proxy compatible with kube-proxy, with safe live mode switching."""

__version__ = "0.1.0"
