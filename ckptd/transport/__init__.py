"""How producers and daemons reach each other: the msgpack wire protocol (``wire``),
CurveZMQ for tcp:// (``curve``), the staging arena handed over a Unix socket
(``handoff``), the socket files a daemon binds (``unixsock``) the daemon loop's wake-up pipe (``wakeup``), and the command line's one-shot question
to a daemon (``oneshot``)."""
