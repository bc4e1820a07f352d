"""chronomq.broker: request processors, long polling, client/offset/topic managers, the controller.

``from chronomq.broker.controller import BrokerController`` (imports the store and the delay service)."""
