"""Diffusion math as pure functions of tensors and generators: noise schedules, SNR, timestep samplers, shift."""
