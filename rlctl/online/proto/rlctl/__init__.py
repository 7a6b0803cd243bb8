"""Generated protocol stubs (see rlctl/online/proto/generate.py)."""
