"""The routing core: admission, load view, outlier ejection, scorers and picker, SLO
accounting. Shared by the HTTP front end (`kubellm.gateway.http`) and the endpoint
picker (`kubellm.gateway.epp`); it sends no request and serves no client itself."""
