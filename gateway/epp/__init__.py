"""The endpoint picker (EPP): kubellm's routing core behind a Gateway API implementation.

A gateway's Envoy (Istio, kgateway, Envoy Gateway, ...) calls it over Envoy's external
processing gRPC protocol, as the Gateway API Inference Extension's endpoint picker
protocol says: it reads the request headers and body, asks the routing core
(`kubellm.gateway.routing.scheduler`) where the request goes, answers with the picked
endpoints in the `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic
metadata, then follows the response to release the in-flight count and observe TTFT
and ITL. It sends no request itself: Envoy does.
"""
