"""rsagg: a ResourceSync aggregator (ANSI/NISO Z39.99-2017)."""

__version__ = "0.1.0"
