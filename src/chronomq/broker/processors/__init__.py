"""The broker's request processors, one module per kind of request (as RocketMQ's SendMessageProcessor,
PullMessageProcessor, ClientManageProcessor, ConsumerManageProcessor, AdminBrokerProcessor,
QueryMessageProcessor).

Each module holds a mixin of ``broker.processor.BrokerProcessor``, which is the dispatcher from request
code to handler: a mixin's ``_init_<kind>`` sets up its own state and returns its handlers by code. The
mixins work from ``BrokerServices`` only (never the controller) and do not call one another, except
through the shared helpers of ``base.py``. Mixins rather than delegating objects: a handler is a method
of the processor, so the send and pull paths pay no extra call, and a tool that patches
``BrokerProcessor._pull_once`` still sees every pull.
"""
