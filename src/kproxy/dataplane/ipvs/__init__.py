"""ipvs mode: IPVS virtual servers over netlink, kube-ipvs0, ipsets and a small iptables layer,
compatible with upstream kube-proxy's ipvs proxier (pkg/proxy/ipvs)."""
