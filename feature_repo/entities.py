"""Feast entities of project `gr2`: the user whose history we read and the items we re-rank."""

from feast import Entity, ValueType

user = Entity(
    name="user",
    join_keys=["user_id"],
    value_type=ValueType.STRING,
    description="A user of the dataset (user_id as in interactions.tsv).",
)

item = Entity(
    name="item",
    join_keys=["item_id"],
    value_type=ValueType.STRING,
    description="A catalog item (item_id as in items.tsv).",
)
