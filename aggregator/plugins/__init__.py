"""pluggy's plugin manager for rsagg (``manager``) and rsagg's own behaviour as default plugins
(``defaults``)."""
