"""Test and benchmark utilities (no SGLang import): launching SGLang servers as subprocesses."""
