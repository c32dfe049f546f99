"""etcd v3 rendezvous for torchrun (``--rdzv-backend=etcd3``).

torch loads the ``torchrun.handlers`` entry point while its own rendezvous
package is still importing, so this package and ``plugin`` must not import
torch's rendezvous modules at top level. Import submodules explicitly.
"""
