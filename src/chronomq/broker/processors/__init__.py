"""The broker's request processors, one module per kind of request (as RocketMQ's SendMessageProcessor,
PullMessageProcessor, ClientManageProcessor, ConsumerManageProcessor, AdminBrokerProcessor,
QueryMessageProcessor).

Each module holds a processor class, built with the broker's services (and, where it shares another's
helpers, that processor: the reply processor takes the send processor), whose ``handlers()`` is its table
``{request code: handler}``. ``broker.processor.BrokerProcessor`` joins the tables into one dispatch
table (a code registered twice is refused) and dispatches each request with one dict lookup and one
bound-method call. The processors work from ``BrokerServices`` only (never the controller) and share
helpers through ``base.py``.
"""
