"""The RocketMQ 4.x remoting protocol: sans-IO codec (codec, codes) plus thin asyncio transports."""
