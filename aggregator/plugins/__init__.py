"""pluggy's plugin manager for rsagg (``manager``); rsagg's own behaviour at each seam is a default plugin
in the stage it belongs to (``store/defaults.py``, ``harvest/defaults.py``, ``publish/defaults.py``)."""
