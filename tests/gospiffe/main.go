// meshca-gospiffe is a SPIFFE Workload API client built on go-spiffe, the
// Go library most workloads use, for the end-to-end tests of meshca-agent's
// socket (tests/tests/go_spiffe_e2e.rs): an independent client beside the
// Rust `spiffe` crate.
//
// Each subcommand prints one JSON object on stdout and exits 0, or prints
// "meshca-gospiffe: <what failed>" on stderr and exits 1 (2 for bad usage):
//
//	x509 --socket PATH [--expect-id ID] [--source] [--mtls] [--timeout D]
//	    FetchX509Context (or, with --source, NewX509Source), each SVID
//	    checked by x509svid.Verify against the bundle served with it;
//	    --mtls: a TLS handshake between tlsconfig.MTLSServerConfig and
//	    MTLSClientConfig of that source, each side authorizing --expect-id.
//	bundles --socket PATH [--timeout D]
//	    FetchX509Bundles.
//	watch --socket PATH --updates N [--expect-id ID] [--timeout D]
//	    WatchX509Context until N updates have arrived, each verified; the
//	    watch errors seen on the way (go-spiffe then reconnects) are
//	    reported. Each update and error is also a line on stderr as it
//	    happens ("meshca-gospiffe: watch: update N serial S").
//	jwt --socket PATH [--audience AUD] [--timeout D]
//	    FetchJWTSVID and FetchJWTBundles: the gRPC status code of each.
//	bundle-source --socket PATH [--trust-domain TD] [--timeout D]
//	    NewBundleSource (which also waits for the JWT bundles): whether it
//	    returns within the timeout, and the error if not.
package main

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/spiffetls/tlsconfig"
	"github.com/spiffe/go-spiffe/v2/svid/jwtsvid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/spiffe/go-spiffe/v2/workloadapi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "x509":
		err = x509Cmd(args)
	case "bundles":
		err = bundlesCmd(args)
	case "watch":
		err = watchCmd(args)
	case "jwt":
		err = jwtCmd(args)
	case "bundle-source":
		err = bundleSourceCmd(args)
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "meshca-gospiffe: %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: meshca-gospiffe x509|bundles|watch|jwt|bundle-source --socket PATH [flags]")
	os.Exit(2)
}

// common holds the flags every subcommand takes.
type common struct {
	socket  string
	timeout time.Duration
}

func flags(name string, c *common) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ExitOnError)
	fs.StringVar(&c.socket, "socket", "", "the Workload API's Unix socket (a path)")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "the most the whole subcommand may take")
	return fs
}

func parse(fs *flag.FlagSet, c *common, args []string) {
	if err := fs.Parse(args); err != nil {
		os.Exit(2)
	}
	if c.socket == "" || fs.NArg() != 0 || c.timeout <= 0 {
		fmt.Fprintf(os.Stderr, "meshca-gospiffe: %s: --socket PATH is required, --timeout positive, no positional arguments\n", fs.Name())
		os.Exit(2)
	}
}

func (c *common) addr() workloadapi.ClientOption {
	return workloadapi.WithAddr("unix://" + c.socket)
}

func (c *common) context() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), c.timeout)
}

func printJSON(v any) error {
	out, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	_, err = fmt.Println(string(out))
	return err
}

// statusOf is an error's gRPC code and message, with a word on a deadline
// that is this program's --timeout rather than the server's.
func statusOf(err error) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Sprintf("%v (--timeout reached)", err)
	}
	s := status.Convert(err)
	return fmt.Sprintf("%s: %s", s.Code(), s.Message())
}

// Bundle is one trust domain's roots.
type Bundle struct {
	TrustDomain string   `json:"trust_domain"`
	Roots       int      `json:"roots"`
	RootSHA256  []string `json:"root_sha256"`
}

func describeBundles(set *x509bundle.Set) []Bundle {
	out := []Bundle{}
	for _, b := range set.Bundles() {
		d := Bundle{TrustDomain: b.TrustDomain().String(), RootSHA256: []string{}}
		for _, root := range b.X509Authorities() {
			sum := sha256.Sum256(root.Raw)
			d.RootSHA256 = append(d.RootSHA256, hex.EncodeToString(sum[:]))
		}
		d.Roots = len(d.RootSHA256)
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].TrustDomain < out[j].TrustDomain })
	return out
}

// SVID is what one X509-SVID holds, once verified.
type SVID struct {
	SpiffeID      string `json:"spiffe_id"`
	Hint          string `json:"hint"`
	Serial        string `json:"serial"`
	NotBefore     string `json:"not_before"`
	NotBeforeUnix int64  `json:"not_before_unix"`
	NotAfter      string `json:"not_after"`
	NotAfterUnix  int64  `json:"not_after_unix"`
	ChainLength   int    `json:"chain_length"`
	KeyType       string `json:"key_type"`
	Verified      bool   `json:"verified"`
	VerifiedChain int    `json:"verified_chain_length"`
}

// checkSVID verifies svid against bundles with x509svid.Verify (path
// validation now, the X509-SVID leaf rules) and, if expect is set, its ID.
func checkSVID(svid *x509svid.SVID, bundles x509bundle.Source, expect string) (SVID, error) {
	leaf := svid.Certificates[0]
	d := SVID{
		SpiffeID:      svid.ID.String(),
		Hint:          svid.Hint,
		Serial:        leaf.SerialNumber.Text(16),
		NotBefore:     leaf.NotBefore.UTC().Format(time.RFC3339),
		NotBeforeUnix: leaf.NotBefore.Unix(),
		NotAfter:      leaf.NotAfter.UTC().Format(time.RFC3339),
		NotAfterUnix:  leaf.NotAfter.Unix(),
		ChainLength:   len(svid.Certificates),
		KeyType:       fmt.Sprintf("%T", svid.PrivateKey),
	}
	if expect != "" && d.SpiffeID != expect {
		return d, fmt.Errorf("the SVID is %s, expected %s", d.SpiffeID, expect)
	}
	id, chains, err := x509svid.Verify(svid.Certificates, bundles)
	if err != nil {
		return d, fmt.Errorf("the SVID %s (serial %s) does not verify against the bundle served with it: %w", d.SpiffeID, d.Serial, err)
	}
	if id != svid.ID {
		return d, fmt.Errorf("x509svid.Verify found %s in a leaf parsed as %s", id, svid.ID)
	}
	if len(chains) == 0 {
		return d, errors.New("x509svid.Verify returned no chain")
	}
	d.Verified = true
	d.VerifiedChain = len(chains[0])
	return d, nil
}

// X509Output is what the x509 subcommand prints.
type X509Output struct {
	API     string   `json:"api"`
	SVIDs   []SVID   `json:"svids"`
	Bundles []Bundle `json:"bundles"`
	MTLS    *bool    `json:"mtls_handshake,omitempty"`
}

func x509Cmd(args []string) error {
	var c common
	fs := flags("x509", &c)
	expect := fs.String("expect-id", "", "fail unless the (default) SVID has this SPIFFE ID")
	useSource := fs.Bool("source", false, "use workloadapi.NewX509Source instead of FetchX509Context")
	mtls := fs.Bool("mtls", false, "with --source: a TLS handshake between the source's server and client configs")
	parse(fs, &c, args)
	if *mtls && !*useSource {
		return errors.New("--mtls needs --source")
	}
	ctx, cancel := c.context()
	defer cancel()

	if !*useSource {
		x509ctx, err := workloadapi.FetchX509Context(ctx, c.addr())
		if err != nil {
			return fmt.Errorf("FetchX509Context: %s", statusOf(err))
		}
		out := X509Output{API: "FetchX509Context", Bundles: describeBundles(x509ctx.Bundles)}
		for i, svid := range x509ctx.SVIDs {
			want := ""
			if i == 0 {
				want = *expect
			}
			d, err := checkSVID(svid, x509ctx.Bundles, want)
			if err != nil {
				return err
			}
			out.SVIDs = append(out.SVIDs, d)
		}
		return printJSON(out)
	}

	source, err := workloadapi.NewX509Source(ctx, workloadapi.WithClientOptions(c.addr()))
	if err != nil {
		return fmt.Errorf("NewX509Source: %s", statusOf(err))
	}
	defer source.Close()
	svid, err := source.GetX509SVID()
	if err != nil {
		return fmt.Errorf("X509Source.GetX509SVID: %w", err)
	}
	d, err := checkSVID(svid, source, *expect)
	if err != nil {
		return err
	}
	bundle, err := source.GetX509BundleForTrustDomain(svid.ID.TrustDomain())
	if err != nil {
		return fmt.Errorf("X509Source.GetX509BundleForTrustDomain(%s): %w", svid.ID.TrustDomain(), err)
	}
	out := X509Output{API: "X509Source", SVIDs: []SVID{d}, Bundles: describeBundles(x509bundle.NewSet(bundle))}
	if *mtls {
		if err := handshake(ctx, source, svid.ID); err != nil {
			return fmt.Errorf("mTLS handshake with the source's SVID: %w", err)
		}
		ok := true
		out.MTLS = &ok
	}
	return printJSON(out)
}

// handshake runs go-spiffe's mTLS configurations (the README's Go example)
// against each other over an in-memory connection, each side presenting
// the source's SVID and authorizing id.
func handshake(ctx context.Context, source *workloadapi.X509Source, id spiffeid.ID) error {
	serverSide, clientSide := net.Pipe()
	defer serverSide.Close()
	defer clientSide.Close()
	if deadline, ok := ctx.Deadline(); ok {
		_ = serverSide.SetDeadline(deadline)
		_ = clientSide.SetDeadline(deadline)
	}
	server := tls.Server(serverSide, tlsconfig.MTLSServerConfig(source, source, tlsconfig.AuthorizeID(id)))
	client := tls.Client(clientSide, tlsconfig.MTLSClientConfig(source, source, tlsconfig.AuthorizeID(id)))
	var wg sync.WaitGroup
	var serverErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		serverErr = server.HandshakeContext(ctx)
	}()
	clientErr := client.HandshakeContext(ctx)
	if clientErr != nil {
		// Unblock the server side.
		clientSide.Close()
	}
	wg.Wait()
	if clientErr != nil {
		return fmt.Errorf("client side: %w", clientErr)
	}
	if serverErr != nil {
		return fmt.Errorf("server side: %w", serverErr)
	}
	peers := server.ConnectionState().PeerCertificates
	if len(peers) == 0 {
		return errors.New("the server saw no client certificate")
	}
	peer, err := x509svid.IDFromCert(peers[0])
	if err != nil || peer != id {
		return fmt.Errorf("the server saw the client as %v (%v)", peer, err)
	}
	return nil
}

func bundlesCmd(args []string) error {
	var c common
	fs := flags("bundles", &c)
	parse(fs, &c, args)
	ctx, cancel := c.context()
	defer cancel()
	set, err := workloadapi.FetchX509Bundles(ctx, c.addr())
	if err != nil {
		return fmt.Errorf("FetchX509Bundles: %s", statusOf(err))
	}
	if set.Len() == 0 {
		return errors.New("FetchX509Bundles: no bundle in the answer")
	}
	return printJSON(map[string]any{"api": "FetchX509Bundles", "bundles": describeBundles(set)})
}

// Update is one X509 context update the watch saw.
type Update struct {
	AtMillis int64    `json:"at_ms"`
	SVID     SVID     `json:"svid"`
	Bundles  []Bundle `json:"bundles"`
}

// WatchOutput is what the watch subcommand prints.
type WatchOutput struct {
	API             string   `json:"api"`
	Updates         []Update `json:"updates"`
	DistinctSerials int      `json:"distinct_serials"`
	WatchErrors     []string `json:"watch_errors"`
}

// watcher records each update (verified) and each watch error.
type watcher struct {
	start  time.Time
	expect string
	want   int

	mu     sync.Mutex
	out    WatchOutput
	failed error
	done   chan struct{}
	once   sync.Once
}

func (w *watcher) OnX509ContextUpdate(x509ctx *workloadapi.X509Context) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.failed != nil || len(w.out.Updates) >= w.want {
		return
	}
	d, err := checkSVID(x509ctx.DefaultSVID(), x509ctx.Bundles, w.expect)
	if err != nil {
		w.failed = fmt.Errorf("update %d: %w", len(w.out.Updates)+1, err)
		w.once.Do(func() { close(w.done) })
		return
	}
	w.out.Updates = append(w.out.Updates, Update{
		AtMillis: time.Since(w.start).Milliseconds(),
		SVID:     d,
		Bundles:  describeBundles(x509ctx.Bundles),
	})
	// Progress for whoever drives the watch (a test waits for it).
	fmt.Fprintf(os.Stderr, "meshca-gospiffe: watch: update %d serial %s\n", len(w.out.Updates), d.Serial)
	if len(w.out.Updates) >= w.want {
		w.once.Do(func() { close(w.done) })
	}
}

func (w *watcher) OnX509ContextWatchError(err error) {
	if status.Code(err) == codes.Canceled {
		return // our own cancel at the end
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	said := fmt.Sprintf("%.1fs %s", time.Since(w.start).Seconds(), statusOf(err))
	w.out.WatchErrors = append(w.out.WatchErrors, said)
	fmt.Fprintf(os.Stderr, "meshca-gospiffe: watch: error %s\n", said)
}

func watchCmd(args []string) error {
	var c common
	fs := flags("watch", &c)
	expect := fs.String("expect-id", "", "fail unless every update's SVID has this SPIFFE ID")
	updates := fs.Int("updates", 2, "how many X509 context updates to wait for (the first answer included)")
	parse(fs, &c, args)
	if *updates < 1 {
		return errors.New("--updates must be at least 1")
	}
	ctx, cancel := c.context()
	defer cancel()
	w := &watcher{
		start:  time.Now(),
		expect: *expect,
		want:   *updates,
		out:    WatchOutput{API: "WatchX509Context", Updates: []Update{}, WatchErrors: []string{}},
		done:   make(chan struct{}),
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	finished := make(chan error, 1)
	go func() { finished <- workloadapi.WatchX509Context(watchCtx, w, c.addr()) }()

	var watchErr error
	select {
	case <-w.done:
	case watchErr = <-finished:
	case <-ctx.Done():
	}
	stopWatch()
	if watchErr == nil {
		<-finished
	}

	w.mu.Lock()
	defer w.mu.Unlock()
	serials := map[string]bool{}
	for _, u := range w.out.Updates {
		serials[u.SVID.Serial] = true
	}
	w.out.DistinctSerials = len(serials)
	if w.failed != nil {
		return w.failed
	}
	if len(w.out.Updates) < w.want {
		reason := "--timeout reached"
		if watchErr != nil {
			reason = "the watch ended: " + statusOf(watchErr)
		}
		return fmt.Errorf("%d of %d updates within %s (%s); watch errors: [%s]",
			len(w.out.Updates), w.want, c.timeout, reason, strings.Join(w.out.WatchErrors, "; "))
	}
	return printJSON(w.out)
}

// Call is the outcome of one call: its gRPC code and message.
type Call struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func callOf(err error) Call {
	if err == nil {
		return Call{Code: "OK"}
	}
	s := status.Convert(err)
	return Call{Code: s.Code().String(), Message: s.Message()}
}

func jwtCmd(args []string) error {
	var c common
	fs := flags("jwt", &c)
	audience := fs.String("audience", "meshca-test", "the JWT-SVID's audience")
	parse(fs, &c, args)
	ctx, cancel := c.context()
	defer cancel()
	svid, err := workloadapi.FetchJWTSVID(ctx, jwtsvid.Params{Audience: *audience}, c.addr())
	out := map[string]any{"fetch_jwt_svid": callOf(err)}
	if err == nil {
		out["jwt_spiffe_id"] = svid.ID.String()
	}
	_, err = workloadapi.FetchJWTBundles(ctx, c.addr())
	out["fetch_jwt_bundles"] = callOf(err)
	if ctx.Err() != nil {
		return fmt.Errorf("--timeout reached: %v", out)
	}
	return printJSON(out)
}

func bundleSourceCmd(args []string) error {
	var c common
	fs := flags("bundle-source", &c)
	trustDomain := fs.String("trust-domain", "cluster.local", "the trust domain whose X.509 bundle to look up once ready")
	parse(fs, &c, args)
	td, err := spiffeid.TrustDomainFromString(*trustDomain)
	if err != nil {
		return fmt.Errorf("--trust-domain: %w", err)
	}
	ctx, cancel := c.context()
	defer cancel()
	start := time.Now()
	source, err := workloadapi.NewBundleSource(ctx, workloadapi.WithClientOptions(c.addr()))
	out := map[string]any{"api": "NewBundleSource", "elapsed_ms": time.Since(start).Milliseconds()}
	if err != nil {
		out["ready"] = false
		out["error"] = err.Error()
		out["timed_out"] = errors.Is(err, context.DeadlineExceeded)
		return printJSON(out)
	}
	defer source.Close()
	out["ready"] = true
	bundle, err := source.GetX509BundleForTrustDomain(td)
	if err != nil {
		return fmt.Errorf("BundleSource.GetX509BundleForTrustDomain(%s): %w", td, err)
	}
	out["bundles"] = describeBundles(x509bundle.NewSet(bundle))
	return printJSON(out)
}
