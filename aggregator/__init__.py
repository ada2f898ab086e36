"""rsagg: a ResourceSync aggregator (ANSI/NISO Z39.99-2017)."""

__version__ = "0.1.0"
#: Where the software lives; named in the default User-Agent (``harvest.user_agent``).
PROJECT_URL = "https://pypi.org/project/rsagg/"
