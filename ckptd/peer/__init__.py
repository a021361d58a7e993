"""The peer tier (docs/tiers.md): daemons hold each other's newest shares in memory.

The only place where daemons talk to each other. ``node`` is the daemon's part (the
``ckptd-peer-serve`` and ``ckptd-peer-send`` threads), ``tier`` the readers' part
(``ckptd.load``, ``load_into`` and ``latest`` on a node whose root lacks a share).
"""
