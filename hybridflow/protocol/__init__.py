"""The batch protocol: ``DataProto`` and its helpers, under verl's names (``verl.protocol`` ->
``hybridflow.protocol``).

``dataproto`` holds the class, ``auto_padding`` verl's process-wide padding switch, ``columns`` what it does to columns (the union conflict rule, metrics
merging, tensors as bytes), ``reshape`` padding and folding rows.

May import: ``utils`` (today it needs nothing of hybridflow: numpy, torch and tensordict only).
"""

from hybridflow.protocol.auto_padding import DataProtoConfig
from hybridflow.protocol.columns import (
    deserialize_single_tensor,
    deserialize_tensordict,
    list_of_dict_to_dict_of_list,
    serialize_single_tensor,
    serialize_tensordict,
    union_numpy_dict,
    union_tensor_dict,
)
from hybridflow.protocol.dataproto import DataProto, DataProtoItem
from hybridflow.protocol.reshape import (
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)

# Shown (and pickled) under the path users import them from, not the module that defines them.
for _cls in (DataProto, DataProtoConfig, DataProtoItem):
    _cls.__module__ = __name__

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoItem",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "serialize_single_tensor",
    "serialize_tensordict",
    "union_numpy_dict",
    "union_tensor_dict",
    "unfold_batch_dim",
    "unpad_dataproto",
]
