"""Reinforcement learning on the shared training core: rollouts, rewards, GRPO and PPO (docs/rl.md)."""
