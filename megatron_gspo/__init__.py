"""megatron-gspo: GSPO reinforcement learning on Megatron-Core."""
