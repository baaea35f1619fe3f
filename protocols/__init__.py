"""marsi's contracts: run config, process-boundary messages, the environment interface. No torch, no Ray."""
