"""A put: pages onto their rendezvous replicas, each page's checksum computed once
(``publish``)."""
