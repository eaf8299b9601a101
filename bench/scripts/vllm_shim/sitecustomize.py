# torchvision / torchaudio / torchcodec in this vLLM venv are CUDA builds next to a CPU torch:
# importing them fails, and transformers / vLLM import them whenever they find them. vLLM
# serves text models without them, so they are hidden (find_spec answers None).
import sys

for name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules[name] = None
