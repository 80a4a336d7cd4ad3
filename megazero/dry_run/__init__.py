"""The dry run: every rank of an N-GPU job on this CPU, the meta device standing in for each GPU and
torch's fake process group for NCCL (tools/dry_run.py; docs/dry_run.md).

    job.py                every rank's real recipe (megazero.run.pretrain) in a process of its own
    roles.py              which ranks a large job simulates: one per role
    steady_state.py       a step of many microbatches from two small ones: the steady state counted
    device_stand_in.py    the meta device as a GPU: device-to-host copies, the memory a step holds
    caching_allocator.py  CUDA's caching allocator: reserved memory beside allocated
    gpu_kernels.py        attention, norms, Adam and collectives as a GPU (or this CPU) runs them
    meta_memo.py          meta kernels' results remembered across a step's repeated calls
    cross_rank_checks.py  what would hang or fail on a cluster, found from every rank's trace
    report.py             the JSON document and the table printed from it
    fits.py, gpus.toml    --gpu: does each rank's reserved peak fit the GPU
    trace.py              each rank's ops in issue order (streams, FLOPs, bytes, events, syncs)
    devices.py            the device model: gpus.toml's datasheets, this CPU's measurements
    timeline.py           the traces placed on a device's streams: step time and its parts
    speed.py              --gpu's timeline (timeline_of) and predict(argv, device, world)
"""
