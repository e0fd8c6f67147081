"""Local checkpoints: per-node files replicated across ranks, for recovery in seconds.

Module paths mirror nvidia-resiliency-ext's `checkpointing.local`, so code moves by
changing an import: `ckpt_managers.local_manager.LocalCheckpointManager`,
`replication.strategies.CliqueReplicationStrategy`, `basic_state_dict.BasicTensorAwareStateDict`.
"""
