"""rsagg's own behaviour at each plugin seam, registered before any third-party plugin."""
