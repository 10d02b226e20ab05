"""Cluster rollout of a proxy-mode switch: the ProxyRollout object, its planner, its controller."""
