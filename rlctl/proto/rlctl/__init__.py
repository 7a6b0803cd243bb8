"""Generated protocol stubs (see rlctl/proto/generate.py)."""
