"""pgoutput: bytes -> typed messages, and the replication framing around them."""

from cdc_apply.pgoutput.decoder import PgOutputDecoder, decode_message
from cdc_apply.pgoutput.framing import Keepalive, XLogData, decode_copy_data, encode_standby_status
from cdc_apply.pgoutput.messages import *  # noqa: F403 - the message types are this package's API

__all__ = ["PgOutputDecoder", "decode_message", "Keepalive", "XLogData", "decode_copy_data",
           "encode_standby_status"]
