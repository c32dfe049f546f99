"""The etcd-native rendezvous handler: node leases, per-round keys, watches, one sealing write."""
