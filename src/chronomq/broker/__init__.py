"""chronomq.broker: the controller, the services it works with (``services.BrokerServices``, built by
``services.build_services``), the request processors that work from those services, long polling,
client/offset/topic managers.

``from chronomq.broker.controller import BrokerController`` (imports the store and the delay service)."""
