"""The routing core: one request's lifecycle (`lifecycle.Ticket`), admission, load view,
outlier ejection, declared profiles over scorers and the picker, SLO accounting, settings.
Shared by the HTTP front end (`kubellm.gateway.http`) and the endpoint picker
(`kubellm.gateway.epp`); it sends no request and serves no client itself."""
