"""The storage nodes as a client sees them: which are live and where pages go
(``directory``, ``placement``), one connection to each (``connection`` over UCX,
``shm_connection`` through shared memory on the same host), what a call carries
(``calls``) and what a refused token means for it (``credentials``)."""
