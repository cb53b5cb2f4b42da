"""TensorDict batches for PPO/GRPO from the log or shards (DESIGN §7); not built yet."""
