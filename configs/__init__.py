"""Training configurations: ``python train.py --config configs/<name>.py``."""
