"""userspace mode: kproxy's own worker processes forward every service connection.

The kernel only steers service traffic (ClusterIP, NodePort, externalIP, LoadBalancer) to a
local proxy port per service port, with nat DNAT/REDIRECT rules in upstream's old userspace
chains (KUBE-PORTALS-CONTAINER / -HOST, KUBE-NODEPORT-CONTAINER / -HOST). Worker processes,
started in their own session so they outlive the controller, accept there and connect to an
endpoint. Modules:

* render.py  - pure: snapshot -> listener table + iptables-restore input (deterministic).
* balancer.py - pure: round robin, ClientIP affinity, which source address a connection uses.
* control.py - the table file, worker status files, spawning, adopting and stopping workers.
* worker.py  - the forwarding process (asyncio, SO_REUSEPORT); tcp.py / udp.py its engines.
* proxier.py - UserspaceDataplane, the Dataplane the sync loop drives.
"""
