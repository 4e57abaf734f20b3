"""The OOM/exception guard: one rank's failure becomes one action every rank agrees on.

- `guard`: the Guard, its store path (`rt.guard()`, fail_fast) and the carried split;
- `microbatch`: `rt.micro_batches`, a batch in micro-batches retried in place on an OOM;
- `attempt`: one attempt's agreement across ranks, and why it cannot deadlock;
- `failure`: what kind of failure an exception is.
"""
