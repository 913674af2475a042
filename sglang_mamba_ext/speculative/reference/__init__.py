"""Reference-only speculative decoding, never on SGLang's serving path (``docs/design.md``,
"Speculative verify" and "Deferred update"): :mod:`.decode_loop`, a plain-torch speculative
decoding loop on the tiny hybrid model (snapshot vs deferred verify) that is the numerical
oracle of the deferred mode's tests; :mod:`.draft_head`, the tiny frozen-KV MTP draft head and
EAGLE tree proposal that loop drafts with; :mod:`.sizing`, bytes of the speculative buffers of
both modes from model shapes (``scripts/plan_spec_memory.py``). No SGLang import.
"""
