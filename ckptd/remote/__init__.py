"""The remote tier: an object store (S3 and the like) that every node's daemon uploads
its committed shares to, and that a fresh node resumes from (docs/tiers.md).

``store`` is the only module that imports the object-store client; ``catalog`` says
what the bucket holds; ``uploader`` is the daemon's upload thread; ``fetch`` reads a
rank's tensors (or files) back; ``retention`` applies ``[remote.retention]``. The tier
itself, as the readers and the daemon see it, is ``ckptd.tiers.bucket``.
"""
