"""The network: flows sharing links max-min fair on simpy, and the collectives of NCCL and gloo
as phases of flows, with their closed forms."""
