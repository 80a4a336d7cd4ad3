"""The one kind of configuration record: a pydantic model, for every settings record of config/ and
zero/ (TrainConfig and its parts, ZeroConfig and its DeepSpeed blocks, PrecisionConfig).

Why pydantic rather than dataclasses: the records that come from a DeepSpeed JSON need what it gives
(key aliases, "5e8"-style numbers, a misspelt key refused, ranges checked), and the records built
from flags gain the same checks for free. A record built in code is then checked as one read from
a file: an unknown field or a value of the wrong kind fails at construction or assignment, naming
the field. Field docstrings are the fields' descriptions. Fields may hold plain dataclasses of the
rooms below (the model's GPTConfig, ops' AdamConfig): those are kept as given.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Record(BaseModel):
    """Base of every configuration record: unknown fields refused, assignments checked."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, arbitrary_types_allowed=True
    )

    def replace(self, **changes):
        """A copy with `changes` applied and checked (dataclasses.replace's meaning): the one way a
        record is copied (pydantic's model_copy(update=...) checks nothing). The copy's
        model_fields_set is this record's plus the changed fields, as model_copy's is: the flag
        merges ask it which keys a DeepSpeed file gave."""
        copy = type(self).model_validate({**self.__dict__, **changes})
        object.__setattr__(copy, "__pydantic_fields_set__", self.model_fields_set | changes.keys())
        return copy
