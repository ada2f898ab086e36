"""The network floor: where rsagg may connect (``outbound``) and when a request is tried again (``retry``)."""
