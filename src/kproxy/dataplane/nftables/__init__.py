"""nftables mode: upstream kube-proxy's `table ip kube-proxy` layout, planned purely and
applied as `nft -f` transactions (see proxier.py for the apply strategy)."""
