"""hybridflow: RL post-training of LLMs on the HybridFlow model.

One driver writes the algorithm as plain Python; each call fans out to a worker group and comes back
as one ``DataProto``.
"""

from hybridflow.protocol import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto

__version__ = "0.1.0"

__all__ = ["DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto", "__version__"]
