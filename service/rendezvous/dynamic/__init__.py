"""torch's DynamicRendezvousHandler on etcd v3: the state backend and its signing, and what admin reads
of that state.
"""
