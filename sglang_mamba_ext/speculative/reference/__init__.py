"""Reference-only speculative decoding: never on SGLang's serving path.

- :mod:`.decode_loop` — a plain-torch speculative decoding loop on the tiny hybrid model
  (snapshot vs deferred verify), the numerical oracle of the deferred mode's tests;
- :mod:`.draft_head` — a tiny frozen-KV MTP draft head and EAGLE tree proposal for that loop;
- :mod:`.sizing` — bytes of the speculative buffers of both modes, from model shapes
  (``scripts/plan_spec_memory.py``).

No SGLang import.
"""
