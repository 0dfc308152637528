"""Starting a run's DeepSpeed ranks on one node or several, before any of them trains (imports core and kernels
only; `training` runs on top of it):

- `settings`: what `auto` means here (accelerator, ranks per node, precision, accumulation, attention) and the
  nodes, resolved once by the stage: `Launch`.
- `cluster`: the nodes as the `launcher` config group names them (local, ssh, slurm, manual): hosts, slots, where
  the ranks meet.
- `preflight`: before a multi-node launch, every node reachable, running this node's code and packages, sharing
  the checkpoint folder (`python -m pipeline.launching.preflight` on each node).
- `ranks`: this node's ranks started early, released once the plan is written (the deepspeed launcher on several
  nodes), ended together.
- `ops`: the ops the ranks use built once per environment (`make setup`); stale op-build locks and shared memory
  cleared before and after a launch.
- `slurm_node`, `manual_node`: one node's launcher under Slurm (srun starts it), or started by hand or by a
  scheduler (`python -m pipeline.launching.manual_node`: it waits for node 0's launch, then starts its ranks).
- `rendezvous`: in each rank, the world joined under a short timeout whose failure names the missing node.
"""
