"""The bucket's internals (the tier itself is ``ckptd.tiers.bucket``): ``store`` (the
only module that imports the client), ``catalog`` (what the bucket holds), ``fetch``
(reading shares back), ``uploader`` (the daemon's thread), ``expiry``
(``[remote.retention]``).
"""
