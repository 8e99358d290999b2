import torch

# The tests run tiny models: on 2 cores, intra-op thread hand-offs cost more than the maths (4x slower measured).
torch.set_num_threads(1)
