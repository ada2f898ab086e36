"""A programmable ResourceSync Source: the upstream the test suite and ``rsagg demo`` harvest from."""
