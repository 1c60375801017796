"""The pool server: the decision core, the runtime that acts, the wire, and what it reports."""
