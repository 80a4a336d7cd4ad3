"""The foundation every other room of megazero imports, and that imports nothing of megazero's:

- `comm`: every collective, behind `Group`, with its byte accounting (`comm_log`: intra- and
  inter-node bytes, the trace);
- `streams`: side streams, the events between them and step timers (a no-op on CPU, with the CPU
  stream sanitizer that enforces CUDA's ordering rules in the tests); `cuda_backends`: the CUDA
  calls behind them;
- `stream_check`: that sanitizer (`op_access`: what each op reads and writes; `nccl_semantics`: how
  NCCL keeps a collective's tensors, by torch version; `stream_check_report`: a launched run's line);
- `records`: `Record`, the one kind of configuration record, copied one way (`replace`, checked);
- `errors`: `UsageError`, the one-line error for bad input, and the checks that raise it.
"""
