// A real OpenID Connect provider for the single sign-on tests: panva's certified oidc-provider,
// configured for one confidential client. Everything comes from environment variables (see
// tools/oidc_provider.py, which starts it); nothing is fetched from the network.
//
//   OIDC_PORT              port to listen on (127.0.0.1 only)
//   OIDC_ISSUER            issuer URL, default http://127.0.0.1:$OIDC_PORT (plain http is allowed)
//   OIDC_CLIENT_ID         the one client's id
//   OIDC_CLIENT_SECRET     its secret; it authenticates with client_secret_post
//   OIDC_REDIRECT_URIS     comma-separated redirect URIs registered for the client
//   OIDC_ACCESS_TOKEN_TTL  access token lifetime in seconds (default 3600)
//   OIDC_ID_TOKEN_TTL      id_token lifetime in seconds (default 3600)
//   OIDC_CODE_TTL          authorization code lifetime in seconds (default 60)
//   OIDC_ACCOUNTS          JSON {"<login id>": {"email", "email_verified", "name", "groups"}};
//                          any other login id is accepted too: email = name = the login id,
//                          email_verified true, groups []
//   OIDC_CONSENT           "auto" (default): consent is granted without a page, as for a
//                          first-party client; "page": the dev consent page is shown
//
// Login goes through oidc-provider's built-in development pages (devInteractions): a form with
// fields "login" and "password" (any password is accepted). Prints "listening on <issuer>" once
// the server accepts connections.
import { generateKeyPairSync, randomBytes } from 'node:crypto';

import Provider from 'oidc-provider';

const env = process.env;
const port = Number(env.OIDC_PORT);
const issuer = env.OIDC_ISSUER || `http://127.0.0.1:${port}`;
const accounts = JSON.parse(env.OIDC_ACCOUNTS || '{}');
const autoConsent = (env.OIDC_CONSENT || 'auto') === 'auto';

// A fresh RSA signing key per run (the built-in development keys would work too, but print a
// warning and are the same for everyone).
const { privateKey } = generateKeyPairSync('rsa', { modulusLength: 2048 });
const signingKey = {
  ...privateKey.export({ format: 'jwk' }), kid: 'test', use: 'sig', alg: 'RS256',
};

// Every login id is a valid account: an unknown one would make the token and userinfo
// endpoints fail with a server error.
function findAccount(ctx, id) {
  const claims = { email: id, email_verified: true, name: id, groups: [], ...accounts[id] };
  return { accountId: id, claims: () => ({ sub: id, ...claims }) };
}

// The grant (scopes and claims consented to) of this login. With OIDC_CONSENT=auto it is made
// or extended to cover the whole request, so the consent page never shows; otherwise it is the
// one the dev consent page saved (oidc-provider's default behaviour).
async function loadExistingGrant(ctx) {
  const { provider, client, account, session, result } = ctx.oidc;
  const grantId = result?.consent?.grantId || session.grantIdFor(client.clientId);
  let grant = grantId ? await provider.Grant.find(grantId) : undefined;
  if (!autoConsent) return grant;
  grant ??= new provider.Grant({ clientId: client.clientId, accountId: account.accountId });
  grant.addOIDCScope([...ctx.oidc.requestParamOIDCScopes].join(' '));
  grant.addOIDCClaims([...ctx.oidc.requestParamClaims]);
  await grant.save();
  return grant;
}

const provider = new Provider(issuer, {
  clients: [{
    client_id: env.OIDC_CLIENT_ID,
    client_secret: env.OIDC_CLIENT_SECRET,
    redirect_uris: (env.OIDC_REDIRECT_URIS || '').split(',').filter(Boolean),
    response_types: ['code'],
    grant_types: ['authorization_code'],
    token_endpoint_auth_method: 'client_secret_post',
  }],
  // Scope -> claims it releases; "groups" is our own scope and claim.
  claims: {
    openid: ['sub'],
    email: ['email', 'email_verified'],
    profile: ['name'],
    groups: ['groups'],
  },
  scopes: ['openid', 'email', 'profile', 'groups'],
  findAccount,
  loadExistingGrant,
  // Chainlit's OAuth client sends no PKCE; 9.x requires it only for public clients, but say so.
  pkce: { required: () => false },
  ttl: {
    AccessToken: Number(env.OIDC_ACCESS_TOKEN_TTL || 3600),
    IdToken: Number(env.OIDC_ID_TOKEN_TTL || 3600),
    AuthorizationCode: Number(env.OIDC_CODE_TTL || 60),
  },
  clockTolerance: 0, // so that expiry tests are exact
  jwks: { keys: [signingKey] },
  cookies: { keys: [randomBytes(32).toString('hex')] },
  features: { devInteractions: { enabled: true } },
});

// Errors the client only sees as a redirect or a 4xx: put them in the log.
for (const event of ['server_error', 'authorization.error', 'grant.error', 'userinfo.error']) {
  provider.on(event, (ctx, err) => {
    console.error(`${event}: ${err?.message} ${err?.error_description || ''}`);
  });
}

const server = provider.listen(port, '127.0.0.1', () => console.log(`listening on ${issuer}`));
process.on('SIGTERM', () => process.exit(0)); // a test provider: nothing to save
